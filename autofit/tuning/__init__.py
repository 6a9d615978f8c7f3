"""One tune as named stages (`tune`): its search space (`space`), validation and the
never-worse rule (`validation`), the frontier it builds (`frontier`) and its `report`."""
