"""``python -m tpu_train.launch --nproc N script.py ...``: see :mod:`tpu_train.distributed.launch`.

``python -m tpu_train.launch pod [options] TPU_NAME "COMMAND"``: the same command on every
worker of a TPU VM slice, see :mod:`tpu_train.distributed.pod` (``scripts/launch_pod.sh``).
"""

import sys

from tpu_train.distributed.launch import main

if __name__ == "__main__":
    if sys.argv[1:2] == ["pod"]:
        from tpu_train.distributed import pod

        raise SystemExit(pod.main(sys.argv[2:]))
    raise SystemExit(main())
