"""Test helpers shared by tests/unit and tests/integration (imported as `helpers.<module>`: the
root conftest's directory, tests/, is on sys.path), and the child-process scripts in
helpers/writers."""
