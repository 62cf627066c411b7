#!/bin/bash
# usage: bash .whl-tpu/judge.sh "TARGET BUDGET" ...   (on the lent TPU machine)
export PYTHONUNBUFFERED=1
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl || exit 3
export PYTHONPATH=$PYTHONPATH:/tmp/site
R=$(pwd); cd /tmp
for tb in "$@"; do
  set -- $tb; t=$1; b=$2; n=$(basename ${t%%.py*})-$(echo $t | sed 's/.*://')
  ( time timeout 280 python3 -m hloopt plan $R/$t --device tpu-v5e --budget $b --judge measured --measure-steps 20 --out $OUT/$n.plan.json ) > $OUT/$n.txt 2>&1
  echo "$t $b rc=$?" >> $OUT/log.txt
done
