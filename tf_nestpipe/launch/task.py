"""`python -m tf_nestpipe.launch.task -- COMMAND ...`: runs COMMAND as the task named by
`TF_CONFIG`, its TensorFlow server listening only on that task's address (for clusters started by
other tools than `python -m tf_nestpipe.launch`, which does this for every task itself)."""
import os
import sys

from tf_nestpipe.launch.listen import listen_only_env
from tf_nestpipe.tf_config import parse_tf_config


def main(argv=None):
    """Sets the listen-only environment from TF_CONFIG and replaces this process by COMMAND."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m tf_nestpipe.launch.task -- COMMAND [ARGS...]")
    config = parse_tf_config()
    if config is None:
        sys.exit("tf_nestpipe.launch.task: TF_CONFIG is not set; it names this task's address.")
    address = config.cluster[config.task_type][config.task_index]
    env = dict(os.environ)
    env.update(listen_only_env(address))
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main()
