"""The node agent's modules; `python -m llmgw.agent.build` joins them into llmgw/agent/llmgw_agent.py."""
