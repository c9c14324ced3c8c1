"""kvproto adapter for vLLM: a KV connector loadable via kv_connector_module_path."""
