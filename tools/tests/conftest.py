"""conftest.py: lets the test modules import _support when pytest runs them."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
