"""Multi-turn, tool-using episodes (docs/environments.md): the environment interface (base.py),
the runner that hosts a user's environment in a contained child process (runner.py), the
built-in calculator and Python interpreter (calculator.py, python_tool.py), and the token-in,
token-out episode builder (episode.py)."""
