"""Scaling beyond one machine, by simulation: what a deployment would do before it is bought.

    simulate.py    a discrete-event simulation of one iteration of each on-policy mode
    calibrate.py   its cost parameters, fitted on measured runs or given for a device
    plan.py        the device split (trainer vs engines) that maximises throughput
"""
