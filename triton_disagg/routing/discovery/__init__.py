"""etcd membership: servers register themselves, the scheduler watches who is there.

- :mod:`.etcd`: the client library (etcd3gw) and the key layout under the prefix.
- :mod:`.record`: what a server publishes (:class:`MemberRecord`, its :class:`Load`, its :class:`ModelRecord` s).
- :mod:`.registration`: a server's lease, heartbeat and load publishing.
- :mod:`.membership`: the scheduler's view of the current members per role.
- :mod:`.metrics_load`: a server's load, read from its own metrics endpoint.

Routing over the members is not here (the scheduler's router uses :class:`Membership`).
"""

from .membership import Membership
from .record import Load, Loads, MemberRecord, ModelRecord
from .registration import Registration

__all__ = ["Load", "Loads", "MemberRecord", "Membership", "ModelRecord", "Registration"]
