"""What a plugin author codes against: value types and rules, nothing that runs.

`backend` (the Backend contract and operand types), `tactics` (Tactic, Problem,
operations and precision policies), `device`, `candidates`, `buckets` (which problems
share a winner) and `hookspecs` (the one hook). Bottom layer, beside
`fp4_dispatch.format` and `fp4_dispatch.support`: nothing here loads, ranks or runs.
"""
