import os
from tests.support.s3 import SeaweedS3
import tensorstore as ts
def test_two_servers_and_inherited_credentials(monkeypatch):
  monkeypatch.setenv("AWS_ACCESS_KEY_ID", "someone")
  monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "else")
  with SeaweedS3() as a, SeaweedS3() as b:
    for s in (a, b):
      kv = ts.KvStore.open({"driver": "s3", "bucket": s.bucket, "endpoint": s.endpoint, "aws_region": "us-east-1"}).result()
      kv.write("k", b"v").result()
      assert kv.read("k").result().value == b"v"
    dirs = [a._dir, b._dir]
  assert not any(os.path.exists(d) for d in dirs)
