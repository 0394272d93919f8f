"""Wiring: the controller that owns every part of the control plane."""

from llmgw.control.controller import Controller, ControllerConfig

__all__ = ["Controller", "ControllerConfig"]
