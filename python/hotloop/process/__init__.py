"""Processes hotloop starts: a stage process and its client end (stage.py), and their lifecycle (lifecycle.py:
die with the parent, stop with escalation)."""
