import os
import sys

# Distributed workers are spawned with the same interpreter and import the tests as modules.
sys.path.insert(0, os.path.dirname(__file__))
