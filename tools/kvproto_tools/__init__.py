"""kvproto command-line tools: simulate, conformance, bench."""
