-- Every UPDATE the store sends rewrites rows its command loaded under a row lock, so it
-- finds each of them; one that found fewer would drop part of a decision. The store
-- sends a transaction's last writes and its COMMIT in one pipeline, so a shortfall the
-- store counted only from the answers would surface after the COMMIT had kept the rest.
-- Each such update now counts its own rows (`WITH w AS (UPDATE ... RETURNING 1) SELECT
-- rows_found(...)`): a shortfall is an error inside the transaction, which aborts it,
-- and the COMMIT behind it rolls back.
-- SQLSTATE XX001 (data_corrupted), naming the table, what was found and what was due.
CREATE FUNCTION rows_found(got BIGINT, due BIGINT, what TEXT) RETURNS BIGINT
LANGUAGE plpgsql AS $$
BEGIN
    IF got IS DISTINCT FROM due THEN
        RAISE EXCEPTION 'an update of % found % of the % rows it had loaded', what, got, due
            USING ERRCODE = 'data_corrupted';
    END IF;
    RETURN got;
END
$$;
REVOKE ALL ON FUNCTION rows_found(BIGINT, BIGINT, TEXT) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION rows_found(BIGINT, BIGINT, TEXT) TO ql_runtime;
