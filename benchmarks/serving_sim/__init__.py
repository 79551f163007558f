"""Serving simulator for head-wise SWA page recycling (driven by benchmarks/bench_recycling.py --engine sim).

hardware    accelerator presets (HBM bandwidth, dense bf16 FLOP/s, memory) with their sources
step_model  roofline time of one engine step from the model's shapes
workload    seeded Poisson / burst arrivals with fixed or sampled lengths
simulator   the real ResourceManagerV1 + PrefixCacheManager on a virtual clock; A/B rows
report      the README table and the plot
cli         the --engine sim command line
(the scheduler driver it runs on: fastdeploy/engine/sched/driver.py; the Hackathon No.53 PR1 study, one
parameter fitted on one cell and the rest predicted: tests/sim/seed_t53.py)
"""
