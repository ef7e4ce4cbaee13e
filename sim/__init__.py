"""Ferry's fleet simulator: a discrete-event simulation on a virtual clock.

It drives the very policy classes the node and the gateway import (`serving.policies.batching`,
`serving.policies.admission`, `serving.policies.autoscale`, `rollout.routing`) over modelled
latency profiles, memory footprints and cold starts on a heterogeneous fleet. Plain Python and
numpy; no Django. `python -m sim.report` runs the shipped scenarios and writes docs/simulation.md.
"""
