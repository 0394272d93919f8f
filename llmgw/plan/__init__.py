"""`llmgw diff`: catalog changes, validation, and the plan against the fleet (DESIGN §3)."""

from llmgw.plan.plan import FleetSnapshot, Plan, make_plan
from llmgw.plan.render import DiffReport, render_json, render_markdown, render_text, summary_line
from llmgw.plan.report import build_report

__all__ = ["DiffReport", "FleetSnapshot", "Plan", "build_report", "make_plan", "render_json", "render_markdown",
           "render_text", "summary_line"]
