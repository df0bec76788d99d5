"""Scale-out: worker ranks placed by Ray across the nodes of a cluster (`ray_executor`). Ray is
imported only by the launcher that asks for it (`--distributed-executor-backend ray`, extra `ray`)."""
