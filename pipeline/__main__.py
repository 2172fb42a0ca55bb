import sys

from pipeline.cli import COMMANDS, exit_process, main

if __name__ == "__main__":
    code = main()
    command = COMMANDS.get(sys.argv[1]) if len(sys.argv) > 1 else None
    if command is not None and not command.teardown:
        exit_process(code)
    raise SystemExit(code)
