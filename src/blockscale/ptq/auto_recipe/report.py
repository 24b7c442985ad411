"""The automatic recipe's report: one row per unit (its parameters, each candidate's score and bits per weight,
the chosen scheme) and the table printed from them."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

SCORE_UNITS = {"fisher": "estimated increase of the mean next-token loss, nats per token",
               "output": "mean squared output error per token, not normalised"}


@dataclass(frozen=True)
class ReportRow:
    """One unit: ``unit`` its label, ``kind`` ("linear" / "experts" / "expert-linears"), ``match`` the recipe
    rule selecting it, ``params`` its weight elements, ``counted`` the parameters the budget counts (``params``,
    or the active ones with cost "active"), ``scores`` / ``bits`` per candidate (None where the candidate does
    not fit the unit; bits: stored bits per weight, scales included), ``chosen`` the chosen candidate's label."""

    unit: str
    kind: str
    match: str
    params: int
    counted: float
    scores: tuple[Optional[float], ...]
    bits: tuple[Optional[float], ...]
    chosen: str

    def to_dict(self) -> dict:
        d = asdict(self)
        d["scores"], d["bits"] = list(self.scores), list(self.bits)
        return d


def _score(v: Optional[float], chosen: bool) -> str:
    return "-" if v is None else f"{v:.3e}" + ("*" if chosen else "")


def table(rows, labels, *, estimator: str, cost: str, budget: float, achieved: float, objective: float,
          tokens: int) -> list[str]:
    """The report as text lines: a heading, one line per unit (scores per candidate, the chosen one starred,
    "-" where a candidate does not fit), then the effective bits against the budget."""
    active = cost == "active"
    head = ["unit", "params"] + (["active"] if active else []) + list(labels) + ["chosen", "bits"]
    body = []
    for r in rows:
        k = list(labels).index(r.chosen)
        body.append([r.unit, f"{r.params:,}"] + ([f"{r.counted:,.0f}"] if active else [])
                    + [_score(v, i == k) for i, v in enumerate(r.scores)] + [r.chosen, f"{r.bits[k]:.4f}"])
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]

    def fmt(line):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()

    counted = sum(r.counted for r in rows)
    return ([f"auto-recipe: {estimator} scores ({SCORE_UNITS[estimator]}) of {len(rows)} units on {tokens:,} "
             "calibration tokens; * = chosen"]
            + [fmt(head)] + [fmt(line) for line in body]
            + [f"effective bits {achieved:.4f} of budget {budget:g} (cost {cost}: over {counted:,.0f} "
               f"{'active ' if active else ''}parameters of the quantizable units); total score {objective:.4e}"])


__all__ = ["ReportRow", "SCORE_UNITS", "table"]
