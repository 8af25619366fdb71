"""`python -m launch.bench SUBCOMMAND ...`: the same as `tfscale-bench`."""

from launch.bench import run

if __name__ == "__main__":
    run()
