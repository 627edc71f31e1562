"""The parts of `bench/fleet_scale.py`."""
