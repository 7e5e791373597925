def pytest_configure(config):
    config.addinivalue_line(
        "markers", "examples: runs the examples/ scripts as real multi-process clusters "
                   "(about 2 minutes per transport on 2 cores; deselect with -m 'not examples')")
