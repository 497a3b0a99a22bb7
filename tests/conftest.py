import os
import sys

import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))  # tests/reference.py

torch.set_num_threads(1)  # pytest -n 2 runs two workers on two cores
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
# pytest --hypothesis-profile=deep: thousands of cases for a developer (tests/test_fuzz_routes.py: 400 per route).
settings.register_profile("deep", max_examples=400, deadline=None)
settings.load_profile("ci")
