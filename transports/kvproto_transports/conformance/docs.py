"""The case list of ``spec/transport-authors.md`` §6, generated from the registry.

Regenerate with ``python -m kvproto_transports.conformance.docs``; a test checks the guide
contains exactly this text, so the documentation cannot drift from the cases.
"""

from __future__ import annotations

from kvproto_transports.conformance.registry import all_cases


def cases_markdown() -> str:
    """Every case grouped by concern: id, title, level, requirement, what it protects."""
    lines: list[str] = []
    group = None
    for c in all_cases():
        if c.group != group:
            group = c.group
            lines += ["", f"### {c.id.split('.')[0]} {group}", ""]
        lines += [
            f"**{c.id} {c.title}** ({c.level.value})  ",
            f"{c.requirement}  ",
            f"*Protects:* {c.protects}",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(cases_markdown())
