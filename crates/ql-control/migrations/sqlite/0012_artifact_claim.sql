-- The receipt of the first upload confirmed for an attempt's artifact: the database, not
-- the artifact store, decides which content an attempt's artifact is (an S3 service's
-- conditional write may not be atomic).
ALTER TABLE attempts ADD COLUMN claimed_artifact TEXT;
