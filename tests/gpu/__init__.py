"""tests/gpu/: what a lent GPU checks in one device call (gpu_session.sh): the device check (device_check.py,
with its kernel and sync sections, dequantize_check.py and sync_check.py) besides `pytest -m cuda`. The test
suite runs their Python on the CPU with small shapes (tests/test_device_check.py)."""
