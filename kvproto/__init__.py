"""kvproto: KV-cache block leases for disaggregated prefill/decode serving (sans-I/O core)."""
