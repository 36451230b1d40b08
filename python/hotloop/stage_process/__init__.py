"""Processes hotloop starts: a stage process and its client end (stage.py), the messages every stage takes
(messages.py: abort, shut down), and their lifecycle (lifecycle.py: die with the parent, stop with escalation).
Nothing here imports the engine: the engine and the orchestrator build on this layer."""
