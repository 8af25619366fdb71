"""`python -m tfscale.launch.bench SUBCOMMAND ...`: the same as `tfscale-bench`."""

from tfscale.launch.bench import run

if __name__ == "__main__":
    run()
