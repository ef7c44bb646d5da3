import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # reference_model.py: the tests' tiny models and numpy reference
