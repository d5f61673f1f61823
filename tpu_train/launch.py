"""``python -m tpu_train.launch --nproc N script.py ...``: see :mod:`tpu_train.distributed.launch`."""

from tpu_train.distributed.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
