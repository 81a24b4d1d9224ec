"""The engine loops an end-to-end module runs against: scheduler flags per mode.

sync: each step is planned once the previous step's result is back. async: the next step is planned
and sent while the worker runs the current one (--async-scheduling). multi_step: a batch of decodes
runs up to 4 steps per call to the worker (--num-scheduler-steps 4).
"""

SCHEDULING: dict[str, list[str]] = {"sync": [], "async": ["--async-scheduling"],
                                    "multi_step": ["--num-scheduler-steps", "4"]}
