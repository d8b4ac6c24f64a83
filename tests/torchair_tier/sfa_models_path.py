"""Puts ``tests/`` on ``sys.path`` so the torchair tier (and its spawned ranks) can import the
shared test models (``sfa_models``)."""

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
