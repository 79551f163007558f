"""Serving simulator for head-wise SWA page recycling (driven by benchmarks/simulate_serving.py).

hardware    accelerator presets (HBM bandwidth, dense bf16 FLOP/s, memory) with their sources
step_model  roofline time of one engine step from the model's shapes
workload    seeded Poisson / burst arrivals with fixed or sampled lengths
simulator   the real ResourceManagerV1 + PrefixCacheManager on a virtual clock; A/B rows
report      the README table and the plot
seed_t53    the Hackathon No.53 PR1 measurement: one parameter fitted on one cell, the rest predicted
"""
