"""Edge agent: a NATS JetStream island on each device, linked to the hub as a leaf node."""

__version__ = "0.1.0"
