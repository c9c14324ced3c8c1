"""Transport bindings for kvproto: loopback, NIXL, UCX, and the conformance kit."""
