"""A consumer process for test_bus_redis: logs each batch's ids, then acks; stops mid-batch when told.

argv: redis_url stream consumer log_path stop_after_batches
After `stop_after_batches` acked batches it reads one more batch, writes "<log>.midbatch" and sleeps
(never acking) until the test kills it.
"""

import asyncio
import sys
import time
from pathlib import Path

from molt.bus.redis_stream import RedisTrajectoryQueue


async def main(url: str, stream: str, consumer: str, log_path: str, stop_after: int) -> None:
    q = RedisTrajectoryQueue(url, stream)
    log = open(log_path, "a")
    for _ in range(stop_after):
        batch = await q.read(consumer, 100, block_s=5)
        log.write("".join(d.trajectory.trajectory_id + "\n" for d in batch))
        log.flush()
        await q.ack(batch)
    batch = await q.read(consumer, 100, block_s=5)
    Path(log_path + ".midbatch").write_text(str(len(batch)))
    while True:
        time.sleep(1)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5], int(sys.argv[5])))
