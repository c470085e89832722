"""Scheduling algorithms over a numeric placement problem (`problem.Problem`): optimal placement by
dynamic programming, pipelining for streams, the documented baselines, and a simulator that plays a
plan on the devices' queues and links. `graph.build_problem` builds the problem
from a graph and a target's cost model, for the schedule stage and for the package stage's re-costing;
`planner.make_plan` is the schedule stage's whole decision (placement, inter-op parallelism in
`interop`, segments cut in `segments`, the plan), `explain` its HTML report."""
