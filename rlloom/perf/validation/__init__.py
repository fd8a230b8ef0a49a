"""The cost model checked: against a measured run (`validate.py`), a stochastic replay of its
steps (`simulate.py`) and published runs (`published.py`)."""
