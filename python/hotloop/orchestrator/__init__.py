"""Event-driven multi-stage orchestrator: LLM engine stages and transform stages, a reader per replica, one
dispatch queue, replica eviction, runtime membership; the legacy poll loop as its A/B baseline."""

from hotloop.errors import OrchestratorBrokenError, ReplicaDeadError
from hotloop.orchestrator.orchestrator import ENV_EVENT_DRIVEN, Monitor, Orchestrator, StageSpec
from hotloop.orchestrator.packet import Packet
from hotloop.orchestrator.replica import Replica

__all__ = ["ENV_EVENT_DRIVEN", "Monitor", "Orchestrator", "OrchestratorBrokenError", "Packet", "Replica",
           "ReplicaDeadError", "StageSpec"]
