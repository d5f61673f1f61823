# tpu_train for a TPU host: the CPU-only torch wheel (a TPU needs no CUDA build) and the [tpu]
# extra (libtpu), every version from constraints.txt. Built and pushed as in docs/tpu.md:
#   docker build -t IMAGE . && docker push IMAGE
# On GKE the JobSet (scripts/gke/render_jobset.py) or XPK gives the command; `docker run IMAGE
# ARGS` runs `tpu-train ARGS`.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /app

# torch first, in a layer of its own: it changes only with constraints.txt, not with the code.
COPY constraints.txt ./
RUN pip install "$(grep -m1 '^torch==' constraints.txt)" --index-url https://download.pytorch.org/whl/cpu

# The package (not editable: configs and recipes come from the installed wheel, as for a user),
# with scripts/ beside it for scripts/gke/tpu_env.py.
COPY . .
RUN pip install -c constraints.txt ".[tpu]"

ENTRYPOINT ["tpu-train"]
CMD ["--help"]
