import os
import sys

import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))  # tests/reference.py

torch.set_num_threads(1)  # pytest -n 2 runs two workers on two cores
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")
