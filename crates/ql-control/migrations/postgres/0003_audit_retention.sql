-- Audit retention: the sweeper prunes the oldest audit records, by age and by count. An
-- audit record is still never rewritten, by anyone; it is removed only through
-- prune_audit, which the owner owns and which removes only from the old end: records
-- older than a cutoff, and all but the newest `keep`. The runtime role may call it and
-- still has no DELETE of its own.
CREATE INDEX audit_at ON audit (at);

DROP TRIGGER audit_append_only ON audit;
CREATE TRIGGER audit_append_only BEFORE UPDATE ON audit
    FOR EACH ROW EXECUTE FUNCTION append_only();
CREATE TRIGGER audit_pruned_only BEFORE DELETE ON audit
    FOR EACH ROW WHEN (current_setting('ql.audit_prune', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION append_only();

-- Removes the records older than `cutoff` (milliseconds since the epoch; NULL keeps every
-- age) and all but the newest `keep` (NULL keeps every count); returns how many went.
CREATE FUNCTION prune_audit(cutoff BIGINT, keep BIGINT) RETURNS BIGINT
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public AS $$
DECLARE
    aged BIGINT := 0;
    counted BIGINT := 0;
BEGIN
    PERFORM set_config('ql.audit_prune', 'on', true);
    IF cutoff IS NOT NULL THEN
        DELETE FROM audit WHERE at < cutoff;
        GET DIAGNOSTICS aged = ROW_COUNT;
    END IF;
    IF keep IS NOT NULL THEN
        DELETE FROM audit WHERE seq <= (SELECT max(seq) FROM audit) - keep;
        GET DIAGNOSTICS counted = ROW_COUNT;
    END IF;
    PERFORM set_config('ql.audit_prune', 'off', true);
    RETURN aged + counted;
END
$$;
REVOKE ALL ON FUNCTION prune_audit(BIGINT, BIGINT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION prune_audit(BIGINT, BIGINT) TO ql_runtime;
