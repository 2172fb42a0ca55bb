import sys

from pipeline.cli import main

if __name__ == "__main__":
    code = main()
    if sys.argv[1:2] == ["train"]:  # as launch/pretrain.py: no interpreter teardown after a run
        from pipeline.train.run import exit_process

        exit_process(code)
    raise SystemExit(code)
