"""``kvproto chaos``: faults mixed with traffic on the real P/D deployment, and a checker.

spec/chaos.md is its manual: what it injects, what it records, what the checker
proves and against which bounds.
"""
