"""What one benchmark report holds (`Report`), and its JSON form."""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks.agent_traffic import RequestRecord, TrafficConfig
from benchmarks.traffic_stats import NotRun, SystemSummary
from benchmarks.traffic_verdicts import Verdict


@dataclasses.dataclass
class AgentTrafficResult:
    """The planned traffic's run against each system: figures, verdicts, plots and every request."""

    config: TrafficConfig
    plan: dict[str, Any]
    systems: dict[str, SystemSummary | NotRun]
    checks: dict[str, Verdict]
    plots: list[str]
    requests: dict[str, list[RequestRecord]]


@dataclasses.dataclass
class Report:
    """One report. `parts` are the optional parts' own dicts (see `report.run_parts`)."""

    date: str
    mode: str
    machine: dict[str, Any]
    load_average_start: float
    load_average_end: float
    agent_traffic: AgentTrafficResult
    parts: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The report as `report.json` holds it; requests without their replies (random text of a
        random model: noise in the file)."""
        data = dataclasses.asdict(self)
        for records in data["agent_traffic"]["requests"].values():
            for record in records:
                record.pop("reply", None)
        return data
