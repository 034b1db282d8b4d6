"""Test helpers shared by the test modules: real stores, real DICOM, real servers and real damage to build them
from (imported as ``from helpers.labelled_store import ...``; pyproject's pytest ``pythonpath`` puts tests/ on
the path)."""
