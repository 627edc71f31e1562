"""Hub side: provisioning of the fleet's streams, the device registry, and the Spark ingest."""
