"""Wiring: the controller that owns every part of the control plane."""

from llmgw.control.config import ControllerConfig
from llmgw.control.controller import Controller

__all__ = ["Controller", "ControllerConfig"]
