"""The Ray executor: device groups as Ray actors (`cluster.py` places them, `executor.py`
drives them for the step loop). Nothing outside this package imports Ray at module level."""
