"""The mesh's dimensions and their default order: their own module so that the validation
steps (checks.py) read them without importing the schema that calls those steps."""

DIMS = ("dp", "pp", "cp", "tp")  # the mesh dimensions; ep is laid over dp x cp
DEFAULT_ORDER = ("tp", "cp", "pp", "dp")  # innermost first: tp stays inside a node
