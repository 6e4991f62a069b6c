import os
import sys

# Ranks start with `spawn` and import test workers by module name.
sys.path.insert(0, os.path.dirname(__file__))
